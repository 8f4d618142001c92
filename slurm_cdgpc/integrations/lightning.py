"""`CdgpcProgress`: a Lightning callback that reports ``trainer.global_step`` of its total.

``Trainer(callbacks=[CdgpcProgress()])``, for ``lightning.pytorch`` or ``pytorch_lightning``.
The total is ``max_steps`` when set, else ``estimated_stepping_batches`` when finite.
"""

from __future__ import annotations

import math
from typing import Any

from slurm_cdgpc.integrations import framework_class, progress_hook

_Callback: Any = framework_class(
    ("lightning.pytorch", "pytorch_lightning"), "Callback", "lightning"
)


def trainer_total(trainer: Any) -> int | None:
    """The steps ``trainer`` will take in all, if it knows."""
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return int(trainer.max_steps)
    try:
        estimated = float(trainer.estimated_stepping_batches)
    except Exception:  # Lightning raises when it cannot tell (no length, no max_steps)
        return None
    return int(estimated) if math.isfinite(estimated) and estimated >= 1 else None


class CdgpcProgress(_Callback):  # type: ignore[misc]
    """Reports the trainer's step and total to the node agent (`slurm_cdgpc.integrations`)."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._total = trainer_total(trainer)
        progress_hook().report(trainer.global_step, self._total)

    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        progress_hook().report(trainer.global_step, getattr(self, "_total", None))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        progress_hook().report(trainer.global_step, getattr(self, "_total", None))
