"""A package manager's transcript at the end of a paste (pip, uv, poetry, conda/mamba): an install that went
through, which names old and new releases but no failure (diagnose/parse.py reads it as the fact install_ok_end)."""

from __future__ import annotations

import re

# A package manager's report that an install went through (pip, uv, poetry, conda/mamba), and what it may print
# after that: its notices and the list of the packages it changed. A transcript that ends there (or in a question the
# user typed after it) names the old and new releases but no failure: its upgrade command is no version symptom.
_INSTALL_DONE = re.compile(
    r"^(Successfully installed \S|Installed \d+ packages? in \d|Audited \d+ packages? in \d|Writing lock file$|"
    r"Package operations: \d+ installs?|No dependencies to install or update|Installing the current project: |"
    r"Executing transaction: (\S+ )*done$|Transaction finished$|All requested packages already installed)")
_INSTALL_AFTER = re.compile(
    r"^(\[notice\]|WARNING: (Running pip|You are using pip|The scripts? \S+ (is|are) installed|"
    r"Ignoring invalid distribution)|Consider adding this directory to PATH|Note: you may need to restart|"
    r"[-+~] [\w.\[\],-]+==[\w.+!-]+$|"                                # uv's list of removed / added packages
    r"[-•] (Installing|Updating|Downgrading|Removing) [\w.\[\]-]+ \([\w.+!-]+( -> [\w.+!-]+)?\)$|"  # poetry's
    r"Writing lock file$|Installing the current project: |(Preparing|Verifying|Executing) transaction: |"
    r"Transaction (starting|finished)$|==> .* <==$|"
    # conda's own comment block after a create; any other `#` line is the user's note
    r"#\s*$|#\s*(To (de)?activate (this|an active) environment|\$ conda (de)?activate\b))")
# the command that starts the transcript, after any shell prompt ("$ ", "# ", "(env) user@host:~$ ")
_INSTALL_CMD = re.compile(
    r"^(\(\S+\) )?(\S*[$#>%] ?)?(python3? -m )?(pip3?|uv( pip)?|poetry|conda|mamba|micromamba) "
    r"(install|add|update|upgrade|lock|sync)\b")
# a line of the user's outside the transcript that still reports a failure (then the upgrade may well be the cause)
_FAILURE_WORDS = re.compile(
    r"error|exception|traceback|fail|crash|broke|break|wrong|(n't|not|never) (work|run|start|load|train)|"
    r"cannot|can't|unable|\bnan\b|killed|\bhang|stuck|slower|issue|problem|\bbug|regress|out of memory|\bOOM\b|"
    r"\bloss\b|(worked|working|was fine|ran fine) (fine |well )?(with|on|in|under|before)\b|since (upgrad|updat)|"
    r"报错|错误|失败|崩|卡住|显存", re.I)


def _reports_failure(line: str, exception: re.Pattern[str]) -> bool:
    return bool(_FAILURE_WORDS.search(line) or exception.match(line))


def install_ok_end(lines: list[str], exception: re.Pattern[str]) -> bool:
    """The paste ends in a package manager's report of a successful install, followed at most by the manager's own
    notices and package list, then by prose with no failure word that ends in a question; no line of the user's
    above the install command reports a failure either (the user may tell what broke before pasting the upgrade),
    nor does the line just above the manager's closing block (a build that failed on the way: poetry still ends its
    run). `exception` matches a line that states an exception (the parser's own rule), a failure too."""
    done = next((i for i in range(len(lines) - 1, -1, -1) if _INSTALL_DONE.match(lines[i])), None)
    if done is None:
        return False
    above = done
    while above > 0 and (_INSTALL_AFTER.match(lines[above - 1]) or _INSTALL_DONE.match(lines[above - 1])):
        above -= 1
    if above > 0 and _reports_failure(lines[above - 1], exception):
        return False
    # the transcript itself always names the upgrade; the user's prose is what comes before its command
    cmd = next((i for i in range(above - 1, -1, -1) if _INSTALL_CMD.match(lines[i].strip())), None)
    if cmd is not None and any(_reports_failure(x, exception) for x in lines[:cmd]):
        return False
    rest = [x for x in lines[done + 1:] if not _INSTALL_AFTER.match(x)]
    if not rest:
        return True
    # the user's question after the transcript: prose only (no exception, no failure word), the last line asks
    return rest[-1].endswith("?") and not any(_reports_failure(x, exception) for x in rest)
