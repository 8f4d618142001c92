"""`CdgpcProgress`: a Hugging Face ``TrainerCallback`` that reports ``state.global_step`` of
``state.max_steps``: ``Trainer(..., callbacks=[CdgpcProgress()])``."""

from __future__ import annotations

from typing import Any

from slurm_cdgpc.integrations import framework_class, progress_hook

_TrainerCallback: Any = framework_class(("transformers",), "TrainerCallback", "transformers")


def _report(state: Any) -> None:
    total = state.max_steps if isinstance(state.max_steps, int) and state.max_steps > 0 else None
    progress_hook().report(state.global_step, total)


class CdgpcProgress(_TrainerCallback):  # type: ignore[misc]
    """Reports the trainer's step and total to the node agent (`slurm_cdgpc.integrations`)."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _report(state)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _report(state)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _report(state)
