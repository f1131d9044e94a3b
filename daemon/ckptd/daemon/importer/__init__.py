"""`ckptd import`: reading torch.save, DCP and safetensors checkpoints and writing them as ckptd steps."""
