"""promptfoo configs as gatekeeper suites, read as promptfoo 0.123.1 reads them.

Whatever promptfoo gives a meaning gatekeeper cannot honour is refused (exit 2) naming the file, the field and
the fix; an assertion gatekeeper cannot evaluate is kept aside in ``Suite.skipped`` (battery.read refuses it
unless ``--skip-unsupported``), and ``cost``/``latency`` (about the call, not the output) in
``Suite.call_metrics``. One concept a module: ``suites`` (the suites a config or a pointer suite makes), ``config``
(the file, its top-level keys, ``$ref`` and ``defaultTest``), ``tests`` (inline, YAML/JSON/JSONL/CSV files),
``variables`` (``file://`` vars, array vars), ``assertions``, ``cases`` (a test merged with ``defaultTest``),
``prompts``, ``segments`` (a prompt's messages), ``templates`` (custom nunjucks filters, the vars a template reads)
and ``files`` (``file://`` references, globs, warnings).
"""

from __future__ import annotations

from .cases import _cases
from .config import _read, config_name, is_config, referenced
from .suites import _unique, config_file, load_suites, pointed, with_cases

# _read, _cases and _unique: what the tests read of a config without making its suites
__all__ = ["_cases", "_read", "_unique", "config_file", "config_name", "is_config", "load_suites", "pointed",
           "referenced", "with_cases"]
