"""Pipeline parallel, executed: `executor` walks a schedule (core/schedules) on this rank's stages, `stage`
cuts a stage out of the model and splits its backward for ZB-H1."""
