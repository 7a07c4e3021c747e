"""JavaScript's meaning, as promptfoo gives it: values and JSON (``value``), RegExp (``regex``), js-yaml's
reading of YAML (``yaml``), nunjucks templates (``nunjucks``, with nunjucks' filters in ``nunjucks_filters`` and
JavaScript's operators in templates in ``nunjucks_operators``) and js-rouge's Penn Treebank tokenizer that
promptfoo's ``rouge-n`` counts words with (``treebank``), so promptfoo suites mean here what they mean there.

Imports: nothing.
"""
