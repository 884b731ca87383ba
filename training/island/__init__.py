"""The island process: pull, train, publish, repeat. Its state, adopt and publish paths, the
device encoder of its pseudo-gradients, checkpoint, background I/O, multi-host groups and goodput
accounting."""
