"""Torch-free ideas both engines share: the mesh convention, the timeline format, the pipeline schedules as
data, and the work of a Mamba-2 block."""
