"""Training-script linter: the playbook rules that live in the script, not in the model graph.

    findings = graphopt.lint.check_source(open("train.py").read(), "train.py")
    fixed, remaining = graphopt.lint.fix_source(source)

or ``graphopt lint PATH... [--fix] [--format json]`` (exit status 1 while findings remain).
Rules live in ``rules_data.py`` (DataLoader), ``rules_device.py`` (devices and copies),
``rules_training.py`` (the training loop) and ``rules_model.py`` (model structure).
"""

from graphopt.lint.core import RULES, Finding, check_source, fix_source

__all__ = ["RULES", "Finding", "check_source", "fix_source"]
