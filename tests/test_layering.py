"""The layering rule: scheduler never imports torch (it must stay testable in milliseconds)."""

import subprocess
import sys


def test_scheduler_contract_imports_without_torch():
    code = "import sys, engine.contract, scheduler; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
