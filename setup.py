"""Maps the repository's folders onto import packages: core/ is ``forgerl`` and plugins/
is ``forgerl_plugins``. Everything else is in pyproject.toml; this file exists because
setuptools' declarative config cannot rename a folder together with its subpackages."""

from setuptools import find_packages, setup

FOLDERS = {"forgerl": "core", "forgerl_plugins": "plugins"}

packages = []
for package, folder in FOLDERS.items():
    packages.append(package)
    packages += [f"{package}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=FOLDERS)
