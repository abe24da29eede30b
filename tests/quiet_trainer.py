"""The Trainer arguments that keep a test's run quiet and fast, in one place.

Tests and the scripts they launch under ``mpiexec`` (which have the repository on ``PYTHONPATH``)
import these instead of repeating them::

    from tests.quiet_trainer import QUIET, QUIET_NO_VAL
    trainer = pl.Trainer(strategy="mpi_asa", max_steps=3, **QUIET)
"""

#: No logger, no checkpoints, no progress bar, no model summary.
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)

#: :data:`QUIET`, and no validation (neither the sanity check nor the epoch-end loop).
QUIET_NO_VAL = dict(QUIET, limit_val_batches=0, num_sanity_val_steps=0)
