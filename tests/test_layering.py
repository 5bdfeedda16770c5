"""The layering rules that import-linter cannot see (.importlinter holds the rest; `make test` runs it)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_scheduler_contract_imports_without_torch():
    code = "import sys, engine.contract, scheduler; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_engine_config_imports_without_torch():
    """The server's flags are parsed before anything heavy loads."""
    code = "import sys, engine.config, models.options; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_family_file_is_registered():
    from models.registry import FAMILIES, FAMILY_MODULES

    files = {p.stem for p in (ROOT / "models" / "families").glob("*.py") if p.stem != "__init__"}
    assert set(FAMILY_MODULES) == files
    for family in FAMILIES:
        assert family.model.family is family  # the class reads its own declaration
    names = [f.name for f in FAMILIES]
    architectures = [a for f in FAMILIES for a in f.architectures]
    assert len(set(names)) == len(names) and len(set(architectures)) == len(architectures)


# A branch on a model's type outside its family's file: `config.model_type == "qwen2"`, `arch == "llama"`.
FAMILY_BRANCH = re.compile(r"""(model_type|\barch)\s*(==|!=|\bin\b)\s*[("']""")


def test_no_family_branches_outside_the_family_files():
    offenders = []
    for package in ("server", "scheduler", "engine", "models"):
        for path in (ROOT / package).rglob("*.py"):
            if path.parent.name == "families":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if FAMILY_BRANCH.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
