"""The training itself: the loop, the step, evaluation, the task contract, the state."""
