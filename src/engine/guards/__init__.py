"""What stops a run before it goes wrong, each plugged into the loop as a hook."""
