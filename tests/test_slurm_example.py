"""The Slurm example (``examples/slurm/``) and the two-command scripts parse and call what exists.

No Slurm here: the batch script is checked with ``bash -n``; the Python entry and the config it
calls must exist, the config must be a valid LightningCLI config for that entry, and the launcher
must accept the batch script's options (``--dry-run``). The whole flow -- a SIGUSR1 before the time
limit, ``preempted.ckpt``, ``scontrol requeue``, the requeued job resuming -- was run by hand with a
stub ``scontrol`` (docs/checkpoints.md, "Slurm").
"""

from __future__ import annotations

import re
import runpy
import shlex
import subprocess
import sys

import pytest

from tests.mpi_utils import REPO, mpi_env

SBATCH = REPO / "examples" / "slurm" / "train.sbatch"

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("script", [SBATCH, REPO / "run", REPO / ".ci" / "run"])
def test_the_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stderr


def launcher_line() -> list[str]:
    """The batch script's ``lightning-mpi ...`` command, continuation lines joined, as words."""
    text = SBATCH.read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.strip().startswith("lightning-mpi "))
    return shlex.split(line)


def test_the_batch_script_asks_for_the_signal_and_the_requeue():
    directives = [line for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --signal=USR1@90" in directives and "#SBATCH --requeue" in directives
    assert any(line.startswith("#SBATCH --ntasks-per-node=") for line in directives)  # Lightning refuses --ntasks alone
    assert "scontrol requeue" in SBATCH.read_text()


def test_the_python_entry_and_its_config_exist_and_agree_with_the_script(monkeypatch, capsys, tmp_path):
    words = launcher_line()
    entry = next(word for word in words if word.endswith(".py"))
    config = words[words.index("--config") + 1]
    assert (REPO / entry).is_file() and (REPO / config).is_file()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(REPO / entry), "fit", f"--config={REPO / config}", "--print_config"])
    monkeypatch.syspath_prepend(str((REPO / entry).parent))  # as `python examples/digits.py` has it
    main = runpy.run_path(str(REPO / entry), run_name="slurm_entry")["main"]
    with pytest.raises(SystemExit) as ended:
        main()
    printed = capsys.readouterr().out
    assert not ended.value.code, printed[-2000:]
    checkpoints = re.search(r"^CHECKPOINTS=(\S+)", SBATCH.read_text(), re.M).group(1)
    assert f"dirpath: {checkpoints}" in printed  # preempted.ckpt lands where the script looks for it
    assert "strategy: mpi_asa16" in printed and "save_last: true" in printed


def test_the_launcher_accepts_the_batch_scripts_options():
    words = launcher_line()
    args = ["2" if word == '"$SLURM_NTASKS"' or word == "$SLURM_NTASKS" else word for word in words[1:]]
    args = [re.sub(r"\$\{SLURM_CPUS_PER_TASK:-1\}", "1", word) for word in args]
    result = subprocess.run(
        [sys.executable, "-m", "lightning_mpi", "--dry-run", *args],
        cwd=REPO,
        env=mpi_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "examples/digits.py fit --config examples/slurm/digits.yaml" in result.stdout + result.stderr
