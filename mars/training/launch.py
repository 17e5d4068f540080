"""How a training stage starts its processes (params ``train.launch``): one, or ``accelerate launch`` with N.

With ``num_processes: 1`` the ``mars train`` process trains itself. With N > 1 it re-runs the same
command under ``accelerate launch`` (and waits for it), so a DVC stage needs no hand-typed launcher:
``dvc exp run -S train.launch.num_processes=8`` trains on 8 GPUs. ``config_file`` names an accelerate
config (``infra/accelerate/ddp.yaml``, ``fsdp.yaml``, ``deepspeed_zero2.yaml``); its process count is
replaced by ``num_processes``. Without one, the launch is plain data parallel: ``--multi_gpu``, which
is also what runs N gloo processes on a CPU (the trainer passes ``Accelerator(cpu=True)`` there;
``--cpu --num_processes N`` silently starts one). Results do not depend on N (:mod:`.trainer`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from mars.errors import ConfigError

LAUNCHED = "WORLD_SIZE"  # set by accelerate launch / torchrun in every process they start


@dataclass
class LaunchConfig:
    """The ``train.launch:`` section of params.yaml."""

    num_processes: int = 1  # > 1: the stage re-runs itself under accelerate launch with this many processes
    config_file: str | None = None  # an accelerate config (infra/accelerate/*.yaml); null: plain --multi_gpu
    main_process_port: int | None = None  # rendezvous port; null: accelerate's default (29500)

    def __post_init__(self):
        if self.num_processes < 1:
            raise ConfigError(f"num_processes: must be >= 1, got {self.num_processes}")
        if self.config_file is not None and not Path(self.config_file).is_file():
            raise ConfigError(f"config_file: {self.config_file}: no such file (see infra/accelerate/)")
        if self.main_process_port is not None and not 0 < self.main_process_port < 65536:
            raise ConfigError(f"main_process_port: expected a TCP port, got {self.main_process_port}")


def command(cfg: LaunchConfig, module_argv: list[str], environ=os.environ) -> list[str] | None:
    """The ``accelerate launch`` command that runs ``python -m <module_argv>`` in ``num_processes``
    processes; None when this process should train itself (one process, or already launched)."""
    if cfg.num_processes == 1 or LAUNCHED in environ:
        return None
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(cfg.num_processes)]
    if cfg.config_file is not None:
        launch += ["--config_file", cfg.config_file]
    else:
        launch += ["--multi_gpu", "--num_machines", "1", "--dynamo_backend", "no"]
    if cfg.main_process_port is not None:
        launch += ["--main_process_port", str(cfg.main_process_port)]
    return launch + ["-m", *module_argv]
