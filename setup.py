"""Packaging for fglit: every setting is read from settings.ini (the nbdev 2 convention)."""
from configparser import ConfigParser
from pathlib import Path

import setuptools

here = Path(__file__).parent
cfg = ConfigParser(delimiters=["="])
cfg.read(here / "settings.ini", encoding="utf-8")
cfg = cfg["DEFAULT"]

licenses = {"apache2": "Apache-2.0"}   # SPDX expression
statuses = ["1 - Planning", "2 - Pre-Alpha", "3 - Alpha", "4 - Beta", "5 - Production/Stable", "6 - Mature"]
license_expression = licenses[cfg["license"]]
min_python = cfg["min_python"]
py_versions = ["3.10", "3.11", "3.12", "3.13"]

readme = here / "README.md"
setuptools.setup(
    name=cfg["lib_name"],
    version=cfg["version"],
    description=cfg["description"],
    long_description=readme.read_text(encoding="utf-8") if readme.exists() else cfg["description"],
    long_description_content_type="text/markdown",
    author=cfg["author"],
    author_email=cfg["author_email"],
    license=license_expression,
    license_files=["LICENSE"],
    url=cfg["git_url"],
    keywords=cfg["keywords"].split(),
    classifiers=[
        "Development Status :: " + statuses[int(cfg["status"])],
        "Intended Audience :: " + cfg["audience"],
        "Natural Language :: " + cfg["language"],
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ] + ["Programming Language :: Python :: " + v for v in py_versions[py_versions.index(min_python):]],
    packages=setuptools.find_namespace_packages(include=[cfg["lib_path"], cfg["lib_path"] + ".*"], exclude=["*.__pycache__"]),
    include_package_data=True,
    package_data={cfg["lib_path"] + ".paper_numbers": ["*.csv"]},     # the papers' printed numbers (fglit.reproduction.load_paper_numbers)
    python_requires=">=" + min_python,
    install_requires=cfg["requirements"].split(),
    extras_require={"flower": cfg["flower_requirements"].split(), "simulation": cfg["simulation_requirements"].split(),
                    "plots": cfg["plots_requirements"].split(), "tensorboard": cfg["tensorboard_requirements"].split(),
                    "igraph": cfg["igraph_requirements"].split(), "sknetwork": cfg["sknetwork_requirements"].split(),
                    "dev": cfg["dev_requirements"].split() + cfg["simulation_requirements"].split() + cfg["plots_requirements"].split()},
    entry_points={
        "console_scripts": cfg["console_scripts"].split(),
        "nbdev": [f"{cfg['lib_path']}={cfg['lib_path']}._modidx:d"],
    },
    zip_safe=False,
)
