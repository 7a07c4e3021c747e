"""Install OpenFeature's JavaScript server SDK and its OFREP provider once, so tests can query
``gatekeeper flags serve`` with the real JavaScript clients.

    python -m gatekeeper.setup.openfeature_js     # prints where they are (installs them if missing)

The packages come from the npm registry through the system's ``npm``, pinned, into
``$GATEKEEPER_HOME/openfeature-js/ID/node_modules/`` (ID: a digest of the pinned versions); nothing is
fetched once installed. They need node >= 20: the system's node if it is new enough, else the node
``make promptfoo`` installs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from ..errors import GatekeeperError
from ..identity import digest
from . import promptfoo
from .models import home

# name -> version: the SDK, the OFREP provider, and the peer packages each declares, pinned too
PACKAGES = {"@openfeature/server-sdk": "1.23.0", "@openfeature/core": "1.12.0",
            "@openfeature/ofrep-provider": "0.1.3", "@openfeature/ofrep-core": "0.1.4"}
NODE_MAJOR = 20  # @openfeature/server-sdk 1.23 declares engines.node >= 20


def root() -> Path:
    """One folder per set of pinned versions: a change of PACKAGES installs afresh, never over an old install."""
    return home() / "openfeature-js" / digest(PACKAGES)[:12]


def installed() -> bool:
    return all((root() / "node_modules" / name / "package.json").is_file() for name in PACKAGES)


def _major(node: str) -> int:
    try:
        out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout
        return int(out.strip().lstrip("v").split(".")[0])
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


def node() -> Path:
    """A node the packages run on: the system's if it is new enough, else promptfoo's."""
    for candidate in (shutil.which("node"), str(promptfoo.node())):
        if candidate and Path(candidate).is_file() and _major(candidate) >= NODE_MAJOR:
            return Path(candidate)
    raise GatekeeperError(f"the OpenFeature JavaScript clients need node >= {NODE_MAJOR}: install it, or run "
                          "'make promptfoo', which installs one under $GATEKEEPER_HOME")


def install() -> Path:
    """The packages, installed once; returns the folder whose ``node_modules`` holds them."""
    if installed():
        return root()
    path = f"{node().parent}{os.pathsep}{os.environ.get('PATH', '')}"  # npm runs under the node they need
    promptfoo.npm_install([f"{name}@{version}" for name, version in PACKAGES.items()], root(), path,
                          "the OpenFeature JavaScript clients")
    return root()


if __name__ == "__main__":
    try:
        print(install())
    except GatekeeperError as e:  # bad set-up: say why, exit 2 as the CLI does
        sys.stderr.write(f"error: {e}\n")
        raise SystemExit(2) from None
