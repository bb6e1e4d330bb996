"""Pattern injection: set or mix chosen heads' attention toward a named, template or recorded pattern."""

from steer.pattern_injection.method import (
    MAX_TEMPLATE,
    PatternEdit,
    PatternInjection,
    check_template,
    inject_pattern,
)

__all__ = ["MAX_TEMPLATE", "PatternEdit", "PatternInjection", "check_template", "inject_pattern"]
