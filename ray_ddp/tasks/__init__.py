"""Tasks: what one step means for a kind of problem, and how a batch meets the model.
Runs on workers (and on the driver, which picks the task from the data and checks the
model's output on the meta device).

A task decides three things, and the loop only calls it:
- how a batch reaches the device and the model (``batches.py``: nested tensors moved as
  a tree; a dict spread over the forward's keyword arguments when it names them);
- the loss and the metrics, as *sums* (``sums``): the loss summed over the micro-batch's
  units (rows; tokens for a language model, those whose label is not -100), the units
  counted, the correct predictions;
- whether the units of a step vary from batch to batch (masked labels), so the loop
  counts them across the ranks before the backward.
Sums, not means, cross the wire: the loss for backward is the summed loss over the rank's
share of the step's units, so DDP's average over ranks is the exact mean over the global
batch however it is split across ranks and micro-batches, and an all-reduce of the sums
gives exact validation figures however many ranks there are.
"""
