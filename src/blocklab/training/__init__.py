"""Layer 2, training: the losses (`losses`), the step (`step`), one run (`run`)
with its options (`run_config`: `RunConfig`, `SweepConfig`) around the one
chunk loop (`loop`) that `train_model` and `train_sweep` share,
sweeps (`sweep`) over the member axis (`member_axis`), parameters placed on a
mesh by logical-axis rules (`placement`), one model trained on a mesh
(`mesh_training`), checkpoints, joining and launching multi-process jobs."""

from .checkpoint import CheckpointError, load, save
from .launcher import LaunchError, LaunchResult, launch_local
from .losses import (
    lm_loss,
    mask_tokens,
    mlm_loss,
    moe_loss,
    next_token_loss,
    seq2seq_loss,
)
from .member_axis import check_seeds, member_mesh, pad_members, sharded_map
from .optimizers import optimizer, schedule_factor
from .placement import logical_axes, mesh_of, shard
from .run import TrainResult, train_lm, train_model
from .run_config import RunConfig, SweepConfig
from .sharded_checkpoint import restore_sharded, save_sharded
from .sources import HostSource, host_source
from .step import (
    PRECISIONS,
    LMBatches,
    TrainState,
    TrainStep,
    init_state,
    make_train_step,
    step_keys,
    validation_loss,
)
from .sweep import SweepResult, sweep_grid, sweep_optimizer, train_sweep

__all__ = [
    "PRECISIONS",
    "CheckpointError",
    "HostSource",
    "LMBatches",
    "LaunchError",
    "LaunchResult",
    "RunConfig",
    "SweepConfig",
    "SweepResult",
    "TrainResult",
    "TrainState",
    "TrainStep",
    "check_seeds",
    "host_source",
    "init_state",
    "launch_local",
    "lm_loss",
    "load",
    "logical_axes",
    "make_train_step",
    "mask_tokens",
    "member_mesh",
    "mesh_of",
    "mlm_loss",
    "moe_loss",
    "next_token_loss",
    "optimizer",
    "pad_members",
    "restore_sharded",
    "save",
    "save_sharded",
    "seq2seq_loss",
    "shard",
    "schedule_factor",
    "sharded_map",
    "step_keys",
    "sweep_grid",
    "sweep_optimizer",
    "train_lm",
    "train_model",
    "train_sweep",
    "validation_loss",
]
