"""core/ must stay pure Python: importing it pulls in neither torch nor transformers."""

import subprocess
import sys


def test_core_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "import swiftserve.core.scheduler, swiftserve.core.block_manager\n"
        "import swiftserve.core.request_queue\n"
        "import swiftserve.sampling_params, swiftserve.config\n"
        "bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
