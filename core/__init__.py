"""Torch-free ideas both engines share: the mesh convention (and, in time, the timeline format and the
pipeline schedules as data)."""
