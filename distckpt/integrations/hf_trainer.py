"""The Hugging Face `Trainer`, checkpointed through a CheckpointManager and resumed bit for bit.

What a user writes::

    import distckpt
    from distckpt.integrations import hf_trainer

    distckpt.init_distributed()                       # before TrainingArguments: a restart-safe group
    args = TrainingArguments(..., save_strategy="no")  # distckpt saves
    trainer = hf_trainer.make_trainer(model=model, args=args, train_dataset=dataset,
                                      checkpoints=distckpt.CheckpointManager(url), save_every=50)
    trainer.train()                                   # resumes from the newest committed step, if any

`make_trainer` builds a subclass of `transformers.Trainer` (made when first called: transformers
need not be installed to import this module) that saves every `save_every` optimizer steps (step =
the Trainer's global_step) where the Trainer saves its own checkpoints (after the step's logging
and evaluation), with a `TrainerCallback` that puts the restored counters back as training begins,
and whose Accelerator backs its
loaders with torchdata's StatefulDataLoader. A checkpoint holds the model, the optimizer, the
scheduler, the Trainer's prepared loader (its position, the batch it holds ahead and its pass
count), every random stream, the TrainerState
(global step, epoch, log history, best metric) and the Trainer's running loss. `train()` then
resumes through the Trainer's own resume path (its epoch and step counters, its accumulation
boundaries) with the loader's position, the random streams and the rest restored by distckpt
instead of its skip-the-first-batches and its RNG files, which a resume does not reproduce
bitwise.

Not supported: DeepSpeed and FSDP through the Trainer (their checkpoints are their own), a
`train(resume_from_checkpoint=...)` of the Trainer's own folders (refused), dispatching loaders.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from typing import Any, Iterator

from distckpt.errors import ConfigError
from distckpt.integrations import require
from distckpt.state.capture import per_rank
from distckpt.state.kinds.accelerate_loader import next_pass_starts_afresh

__all__ = ["make_trainer", "trainer_class"]

_WHAT = "distckpt.integrations.hf_trainer"
_made: dict[str, type] = {}


def make_trainer(*args: Any, checkpoints: Any, save_every: int, **kwargs: Any) -> Any:
    """A `transformers.Trainer(*args, **kwargs)` (of trainer_class()) checkpointed through the
    CheckpointManager `checkpoints` every `save_every` optimizer steps."""
    return trainer_class()(*args, checkpoints=checkpoints, save_every=save_every, **kwargs)


def trainer_class(base: type | None = None) -> type:
    """The Trainer subclass that checkpoints through a manager, over `base` (a subclass of
    transformers.Trainer of yours; transformers.Trainer by default)."""
    transformers = require("transformers", "transformers", _WHAT)
    base = base or transformers.Trainer
    key = f"{base.__module__}.{base.__qualname__}"
    if key not in _made:
        _made[key] = type("DistckptTrainer", (_Checkpointed, base), {"__module__": __name__})
    return _made[key]


class _Checkpointed:
    """Mixed in before transformers.Trainer: saves through the callback, resumes in train()."""

    # the Trainer's own (set by it): its state, running loss and counters, saved and put back
    state: Any
    _tr_loss: Any
    _total_loss_scalar: float
    _globalstep_last_logged: int
    current_flos: float

    def __init__(self, *args: Any, checkpoints: Any, save_every: int, **kwargs: Any) -> None:
        if type(save_every) is not int or save_every < 1:
            raise ConfigError(f"save_every={save_every!r}: the number of optimizer steps between saves, an int >= 1")
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.checkpoints, self.save_every = checkpoints, save_every
        self._resume_step: int | None = None
        self._saved_step: int | None = None
        self._resume_folder: str | None = None
        self._state: dict[str, Any] | None = None
        self.add_callback(_callback_class()(self))  # type: ignore[attr-defined]

    def train(self, resume_from_checkpoint: Any = None, **kwargs: Any) -> Any:
        if resume_from_checkpoint not in (None, False):
            raise ConfigError("train(resume_from_checkpoint=...): this Trainer resumes from its CheckpointManager's "
                              "newest committed step by itself; call train() without it")
        steps = self.checkpoints.committed_steps()
        self._resume_step = steps[0] if steps else None
        folder = None
        if self._resume_step is not None:  # the Trainer's own resume path computes its counters from this
            folder = self._resume_folder = tempfile.mkdtemp(prefix="distckpt-trainer-")
            with open(os.path.join(folder, "trainer_state.json"), "w") as f:
                json.dump({"global_step": self._resume_step, "train_batch_size": self._train_batch_size}, f)  # type: ignore[attr-defined]
        return super().train(resume_from_checkpoint=folder, **kwargs)  # type: ignore[misc]

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """An evaluation loader built anew at each evaluation, as without persistent workers. The
        Trainer kept one persistent evaluation loader from evaluation to evaluation: it draws its
        workers' base seed from torch's global stream at its first pass only, and its workers carry
        their streams (a masking collator's) from pass to pass; a resumed process started both anew
        at its first evaluation, and every training step after it differed from the uninterrupted
        run's. Built anew, every evaluation draws at the same point in both runs."""
        with _workers_not_persistent(self.args):  # type: ignore[attr-defined]
            return super().get_eval_dataloader(eval_dataset)  # type: ignore[misc]

    def get_train_dataloader(self) -> Any:
        """The training loader without persistent workers: kept from pass to pass, they carry their
        base seed and streams into the next epoch, which a process resumed at an epoch's end
        started anew (drawing a base seed the uninterrupted run did not): every step after it
        differed. Its workers start at each pass instead, in both runs alike."""
        with _workers_not_persistent(self.args):  # type: ignore[attr-defined]
            return super().get_train_dataloader()  # type: ignore[misc]

    def _build_accelerator_args(self, **kwargs: Any) -> Any:
        config = kwargs.get("dataloader_config")
        if config is not None:  # its prepared loaders over a StatefulDataLoader, whose position is saved
            config.use_stateful_dataloader = True
        return super()._build_accelerator_args(**kwargs)  # type: ignore[misc]

    # -- the Trainer's own loading, replaced by distckpt's ------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint: Any, model: Any = None) -> None:
        if resume_from_checkpoint != self._resume_folder:
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        if checkpoint != self._resume_folder:
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]

    def _load_scaler(self, checkpoint: Any) -> None:
        if checkpoint != self._resume_folder:
            super()._load_scaler(checkpoint)  # type: ignore[misc]

    def _load_rng_state(self, checkpoint: Any) -> None:
        if checkpoint != self._resume_folder:  # distckpt restored every stream at the load
            super()._load_rng_state(checkpoint)  # type: ignore[misc]

    def get_resumed_dataloader(self, dataloader: Any, num_batches: int) -> Any:
        if self._resume_folder is not None:
            return dataloader  # restored at its position by the load: nothing to skip
        return super().get_resumed_dataloader(dataloader, num_batches)  # type: ignore[misc]

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        model, train_dataloader = super()._prepare_for_training(  # type: ignore[misc]
            max_steps, train_dataloader, resume_from_checkpoint)
        self._state = {"model": self.model_wrapped, "optimizer": self.optimizer,  # type: ignore[attr-defined]
                       "scheduler": self.lr_scheduler, "loader": train_dataloader,  # type: ignore[attr-defined]
                       "trainer": per_rank({}), "running": per_rank({})}
        if self._resume_step is None:
            self.checkpoints.load_latest(self._state)  # a fresh start: the loader is watched from its first pass
        else:
            self.checkpoints.load(self._state, self._resume_step)
            # the Trainer takes a counted number of batches per epoch and never asks past a pass's last
            next_pass_starts_afresh(train_dataloader)
        return model, train_dataloader

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        super()._maybe_log_save_evaluate(*args, **kwargs)  # type: ignore[misc]
        # where the Trainer saves its own checkpoints: after the step's logging and evaluation, so that a
        # resume goes on from there (its running loss drained into the log history)
        step = self.state.global_step
        if step % self.save_every == 0 and step != self._saved_step:  # it runs again at an epoch's end
            self._distckpt_save()
            self._saved_step = step

    # -- what the callback calls ----------------------------------------------------------------

    def _distckpt_restore_counters(self) -> None:
        """After the loop set its counters up (on_train_begin): the restored ones put back."""
        if self._resume_step is None or self._state is None:
            return
        saved = self._state["trainer"].obj
        fields = {f.name for f in dataclasses.fields(self.state)}  # type: ignore[attr-defined]
        for name, value in saved.items():
            if name in fields:
                setattr(self.state, name, value)  # type: ignore[attr-defined]
        running = self._state["running"].obj
        self._tr_loss = running["tr_loss"]
        for name in ("_total_loss_scalar", "_globalstep_last_logged", "current_flos"):
            setattr(self, name, running[name])
        if self._resume_folder is not None:
            import shutil

            shutil.rmtree(self._resume_folder, ignore_errors=True)

    def _distckpt_save(self) -> None:
        assert self._state is not None  # set up before the first step
        state = self.state  # type: ignore[attr-defined]
        # per rank: is_world_process_zero and the like are each rank's own
        self._state["trainer"] = per_rank({f.name: getattr(state, f.name) for f in dataclasses.fields(state)
                                           if f.name not in ("stateful_callbacks", "trial_params")})
        self._state["running"] = per_rank({"tr_loss": self._tr_loss.detach().clone(),
                                           "_total_loss_scalar": self._total_loss_scalar,
                                           "_globalstep_last_logged": self._globalstep_last_logged,
                                           "current_flos": float(self.current_flos)})
        self.checkpoints.save(state.global_step, self._state, epoch=int(state.epoch or 0))


@contextlib.contextmanager
def _workers_not_persistent(args: Any) -> Iterator[None]:
    """`dataloader_persistent_workers` off while the Trainer builds a loader (it reads the setting
    there, and keeps an evaluation loader when it is on); the setting itself is left as given."""
    persistent = getattr(args, "dataloader_persistent_workers", False)
    if not persistent:
        yield
        return
    args.dataloader_persistent_workers = False
    try:
        yield
    finally:
        args.dataloader_persistent_workers = persistent


def _callback_class() -> type:
    if "callback" not in _made:
        transformers = require("transformers", "transformers", _WHAT)

        class DistckptCallback(transformers.TrainerCallback):  # type: ignore[misc,name-defined]
            """Puts the restored counters back at the start, waits for the save in flight at the end."""

            def __init__(self, trainer: Any) -> None:
                self.trainer = trainer

            def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self.trainer._distckpt_restore_counters()

            def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self.trainer.checkpoints.wait()

        _made["callback"] = DistckptCallback
    return _made["callback"]
