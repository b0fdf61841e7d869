"""Maps the repository's top-level folders onto the single import root ``k3``.

The tree is shaped for readers (``model/``, ``kernels/``, ``services/``, ``protos/``), while code imports
``k3.model``, ``k3.kernels``, ``k3.services`` and ``k3.protos``. setuptools' ``package_dir`` does the mapping;
the package list is derived from the folders so that adding a module never means editing this file.
"""

from pathlib import Path

from setuptools import setup

ROOTS = {
    "k3": "k3",
    "k3.model": "model",
    "k3.kernels": "kernels",
    "k3.services": "services",
    "k3.protos": "protos/k3",
}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages: list[str] = []
    package_dir: dict[str, str] = {}
    here = Path(__file__).parent
    for name, folder in ROOTS.items():
        package_dir[name] = folder
        for init in sorted((here / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(here / folder)
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            packages.append(".".join([name, *rel.parts]) if rel.parts else name)
    return packages, package_dir


packages, package_dir = _packages()
setup(packages=packages, package_dir=package_dir)
