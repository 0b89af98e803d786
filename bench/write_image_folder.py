"""Write an MNIST-style dataset out as an image folder (`train/<class>/*.png`, `test/...`), the
layout `data=image_folder` reads: real images for its end-to-end run and its benchmark.

    python bench/write_image_folder.py /usr/share/datasets/fashion-mnist /tmp/fashion-png \
        --train 3000 --test 1000
"""

import argparse
import sys
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from src.datasets import IDX  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="folder of the four IDX files")
    parser.add_argument("out", type=Path, help="folder to write train/ and test/ into")
    parser.add_argument("--train", type=int, default=None, help="the first N training images")
    parser.add_argument("--test", type=int, default=None, help="the first N test images")
    parser.add_argument("--torchvision-class", default="FashionMNIST")
    args = parser.parse_args()
    source = IDX(args.root, download=False, torchvision_class=args.torchvision_class)
    for split, count in (("train", args.train), ("test", args.test)):
        images, labels = (t[:count] for t in source.split(split).tensors)
        for i, (image, label) in enumerate(zip(images, labels.tolist(), strict=True)):
            folder = args.out / split / f"{label}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image[0].numpy(), mode="L").save(folder / f"{i:05d}.png")
        print(f"{split}: {len(labels)} images in {args.out / split}")


if __name__ == "__main__":
    main()
