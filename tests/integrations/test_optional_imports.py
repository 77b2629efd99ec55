"""The integrations are optional: importing optimshift (or its integrations package, or the third-party policy
module) never imports Lightning, Accelerate or an optimizer library. Checked in a clean interpreter."""

import subprocess
import sys

import pytest

HEAVY = (
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "accelerate",
    "pytorch_optimizer",
    "transformers",
    "verl",
    "deepspeed",
    "ray",
    "tensordict",
)


@pytest.mark.parametrize(
    "statement",
    [
        "import optimshift",
        "import optimshift.integrations",
        "import optimshift.integrations.third_party",
        "from optimshift.integrations import _common",
        "import optimshift.testing",
        "import optimshift.testing.accelerate",
        "import optimshift.cli, optimshift.cli._inspect, optimshift.checkpoint._folders",
    ],
)
def test_importing_optimshift_imports_no_framework(statement):
    code = (
        f"import sys\n{statement}\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{statement} imported {out.stdout.strip()}"


def test_the_framework_modules_do_import_their_framework():
    """The check above can see an import: importing the Accelerate integration and patching imports it."""
    code = (
        "import sys\nimport optimshift.integrations.accelerate as osa\n"
        "before = 'accelerate' in sys.modules\nosa.patch()\nprint(before, 'accelerate' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"], "the module imports Accelerate only when patch() runs"


def test_the_verl_module_without_verl_patches_nothing_and_patch_says_what_to_install():
    code = (
        "import sys\nsys.modules['verl'] = None\n"
        "import optimshift.integrations.verl as osv\nprint(osv.is_patched())\n"
        "try:\n    osv.patch()\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    patched, message = out.stdout.splitlines()
    assert patched == "False"
    assert "pip install 'optimshift[verl]'" in message


def test_the_deepspeed_module_without_deepspeed_patches_nothing_and_patch_says_what_to_install():
    code = (
        "import sys\nsys.modules['deepspeed'] = None\n"
        "import optimshift.integrations.deepspeed as osd\nprint(osd.is_patched())\n"
        "try:\n    osd.patch()\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    patched, message = out.stdout.splitlines()
    assert patched == "False"
    assert "pip install 'optimshift[deepspeed]'" in message


def test_third_party_register_warns_without_its_library():
    """register() with pytorch_optimizer missing: a warning that says so, instead of a silent empty list."""
    code = (
        "import sys, warnings\nsys.modules['pytorch_optimizer'] = None\n"
        "import optimshift.integrations.third_party as tp\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    print(tp.register())\n"
        "print([str(w.message) for w in caught])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    registered, messages = out.stdout.splitlines()
    assert registered == "[]"
    assert "pytorch_optimizer is not installed, so no policy was registered (pip install pytorch-optimizer)" in messages
