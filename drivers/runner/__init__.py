"""What every image- or process-starting driver hands its runner: the environment (``env``) and the
launch command (``launch``)."""
