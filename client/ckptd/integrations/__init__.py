"""Drop-in use of ckptd from the tools trainers already run.

Each module is an optional extra, imported only when used (the core needs none of them):

- ckptd.integrations.transformers: `CkptdCallback` for the Hugging Face Trainer (`ckptd[hf]`)
- ckptd.integrations.accelerate: `save_state`/`load_state` of an Accelerator through ckptd (`ckptd[hf]`)
- ckptd.integrations.lightning: `CkptdCheckpointIO` for PyTorch Lightning (`ckptd[lightning]`)
- ckptd.integrations.peft: adapter-only saves of PEFT models, with their optimizer state (`ckptd[peft]`)
- ckptd.integrations.dcp: `CkptdStorageWriter`/`CkptdStorageReader` for torch.distributed.checkpoint
- ckptd.integrations.deepspeed: `save`/`load` of a ZeRO-1/2/3 engine's partitions in any
  data-parallel size, `load_consolidated` into a plain model (needs `deepspeed`)
"""
