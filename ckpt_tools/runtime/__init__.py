"""The process around the work: the torchrun environment, helper processes that die with their
parent, and the launch of an FSDP job's ranks."""
