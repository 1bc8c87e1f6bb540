"""The process around a job: process-group start-up, pre-emption notices, held-back Ctrl-C,
environment versions, the garbage collector pause and named fault points."""
