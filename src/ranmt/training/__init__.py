"""Training: the trainer (``train``), the label-smoothed loss and multi-process training.

Nothing is imported here, so that ``import ranmt.training.loss`` stays light."""
