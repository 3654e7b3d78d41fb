"""Two jobs: put ``mlx_fill.pth`` and ``mlx_fill.start`` (``adapters/hooks/``) at the root of
site-packages, for wheels (``pip install .``) and editable installs (``pip install -e .``); and keep
the modules only the scripts and tests use (:data:`SCRIPTS_ONLY`) out of the wheel. Everything
else is in pyproject.toml. The hook does nothing unless ``MLX_FILL`` is set."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

# (package, module) used only by scripts/ and tests/: a checkout has them, the wheel does not
SCRIPTS_ONLY = {("mlx_fill.assets", "random_models"), ("mlx_fill.spec", "mtp"),
                ("mlx_fill.spec", "mtp_head"), ("mlx_fill.spec", "mtp_tap")}
HOOKS = [Path(__file__).parent / "adapters" / "hooks" / name for name in ("mlx_fill.pth", "mlx_fill.start")]


class BuildPyWithHooks(build_py):
    """Copies the hook files to the build root, which a wheel installs as purelib root, and
    leaves the scripts-only modules out."""

    def find_package_modules(self, package, package_dir):
        return [m for m in super().find_package_modules(package, package_dir)
                if (m[0], m[1]) not in SCRIPTS_ONLY]

    def run(self):
        super().run()
        if not self.editable_mode:
            for hook in HOOKS:
                self.copy_file(str(hook), str(Path(self.build_lib) / hook.name))

    def get_outputs(self, include_bytecode=1):
        extra = [] if self.editable_mode else [str(Path(self.build_lib) / h.name) for h in HOOKS]
        return super().get_outputs(include_bytecode) + extra


class EditableWheelWithHooks(editable_wheel):
    """Adds the hook files to the root of the editable wheel (next to setuptools' own .pth)."""

    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        files, mapping = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        for hook in HOOKS:
            (Path(unpacked_wheel) / hook.name).write_bytes(hook.read_bytes())
        return files, mapping


setup(cmdclass={"build_py": BuildPyWithHooks, "editable_wheel": EditableWheelWithHooks})
