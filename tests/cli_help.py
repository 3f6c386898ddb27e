"""Reading an argparse ``--help`` text in the CLI tests (test_cli, test_demo)."""

import re


def help_entries(text: str) -> dict[str, str]:
  """``--help`` output as ``{option or positional line: its help text}`` (wrapped lines joined)."""
  entries: dict[str, str] = {}
  current = None
  for line in text.splitlines():
    if re.match(r"  (  )?[^ ]", line):  # an option, a positional or (4 spaces) a subcommand
      invocation, _, help_text = line.strip().partition("  ")
      current = invocation
      entries[current] = help_text.strip()
    elif current is not None and line.startswith("      "):
      entries[current] = (entries[current] + " " + line.strip()).strip()
    else:
      current = None
  return entries
