"""How tensors are computed on this machine, below the model and shared by training and
inference: the precision policy per device, fast dropout masks, oneDNN packed linears,
malloc tuning, oneDNN's primitive-cache cap and host-device sync counting.

Nothing is imported here, so that importing one module does not import the others."""
