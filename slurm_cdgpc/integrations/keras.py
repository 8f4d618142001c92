"""`CdgpcProgress`: a Keras callback that reports the batches trained of
``params["steps"] * params["epochs"]``: ``model.fit(..., callbacks=[CdgpcProgress()])``."""

from __future__ import annotations

from typing import Any

from slurm_cdgpc.integrations import framework_class, progress_hook

_Callback: Any = framework_class(
    ("keras.callbacks", "tensorflow.keras.callbacks"), "Callback", "keras"
)


class CdgpcProgress(_Callback):  # type: ignore[misc]
    """Reports the batches done and the total to the node agent (`slurm_cdgpc.integrations`)."""

    def on_train_begin(self, logs: Any = None) -> None:
        params = getattr(self, "params", None) or {}
        steps, epochs = params.get("steps"), params.get("epochs")
        self._steps: int | None = None
        self._total: int | None = None
        if isinstance(steps, int) and isinstance(epochs, int) and steps > 0 and epochs > 0:
            self._steps, self._total = steps, steps * epochs
        self._epoch = 0
        progress_hook().report(0, self._total)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        steps = getattr(self, "_steps", None)
        if steps is not None:  # without a known epoch length the step is not defined
            progress_hook().report(self._epoch * steps + batch + 1, self._total)
