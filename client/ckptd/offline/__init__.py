"""Read ckptd checkpoints without a daemon: for notebooks, evaluation jobs and conversion scripts.

    from ckptd.offline import list_steps, open_step

    for info in list_steps("/var/lib/ckptd", "run-42"):
        print(info.step, info.path, info.metric)
    step = open_step("/var/lib/ckptd", "run-42")          # the newest committed step
    step.load({"model": model, "optimizer": opt})          # in place, any layout, decoded
    weights = step.state_dict("model")                     # {fqn: whole tensor}

See ckptd.offline.reader for the contracts.
"""

from ckptd.offline.reader import Step, StepInfo, TensorInfo, list_steps, open_step

__all__ = ["Step", "StepInfo", "TensorInfo", "list_steps", "open_step"]
