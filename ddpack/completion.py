"""Shell completion for `ddpack`, written from the command's own parser: a flag added to cli.py completes at once.

    source <(ddpack completion bash)                       # bash: ~/.bashrc
    ddpack completion zsh > "${fpath[1]}/_ddpack"          # zsh: a folder on $fpath, then compinit

Verbs, their flags and the values a flag takes from a fixed list complete; a flag that takes a path completes files
(folders for folder flags); a run (status, logs, ...) completes the run folders and job ids under the runs folder
(DDPACK_RUNS, else the shared default), as `ddpack ls --json` names them.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass

FOLDER_FLAGS = ("--runs", "--images", "--tensorboard")
FILE_FLAGS = ("--sqsh", "--file", "--html", "--csv", "--summary")
RUN_VERBS = ("status", "logs", "cancel", "resubmit", "report", "compare", "rm", "tag", "export")


@dataclass(frozen=True)
class Verb:
    name: str
    help: str
    flags: tuple[tuple[str, str, tuple[str, ...] | None, bool], ...]  # (flag, help, choices, takes a value)
    positional_choices: tuple[str, ...] | None


def verbs(top: argparse.ArgumentParser) -> list[Verb]:
    """Each verb with its flags, read from the parser's own actions."""
    found = []
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help or "" for choice in sub._choices_actions}
    for name, parser in sub.choices.items():
        flags, positional = [], None
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if not action.option_strings:
                positional = tuple(action.choices) if action.choices else positional
                continue
            takes = action.nargs != 0
            for flag in action.option_strings:
                flags.append((flag, (action.help or "").replace("%%", "%"), tuple(action.choices) if action.choices else None, takes))
        found.append(Verb(name, helps.get(name, ""), tuple(flags), positional))
    return found


def bash(top: argparse.ArgumentParser) -> str:
    cases = []
    for verb in verbs(top):
        values = [f"        {flag}) COMPREPLY=($(compgen -W {shlex.quote(' '.join(choices))} -- \"$cur\")); return ;;"
                  for flag, _, choices, _ in verb.flags if choices]  # fmt: skip
        takes = "|".join(
            flag for flag, _, choices, value in verb.flags if value and not choices and flag not in (*FOLDER_FLAGS, *FILE_FLAGS)
        )
        words = " ".join(flag for flag, *_ in verb.flags)
        fallback = (
            f'COMPREPLY=($(compgen -W {shlex.quote(" ".join(verb.positional_choices))} -- "$cur"))'
            if verb.positional_choices
            else (
                'COMPREPLY=($(compgen -W "$(_ddpack_runs)" -- "$cur"))' if verb.name in RUN_VERBS else 'COMPREPLY=($(compgen -d -- "$cur"))'
            )
        )
        cases.append(
            f"    {verb.name})\n"
            f'        case "$prev" in\n'
            + "".join(f"{line}\n" for line in values)
            + f'        {"|".join(FOLDER_FLAGS)}) COMPREPLY=($(compgen -d -- "$cur")); return ;;\n'
            + f'        {"|".join(FILE_FLAGS)}) COMPREPLY=($(compgen -f -- "$cur")); return ;;\n'
            + (f"        {takes}) return ;;\n" if takes else "")
            + "        esac\n"
            + f'        if [[ "$cur" == -* ]]; then COMPREPLY=($(compgen -W {shlex.quote(words)} -- "$cur")); else {fallback}; fi ;;\n'
        )
    names = " ".join(verb.name for verb in verbs(top))
    return (
        "# bash completion for ddpack (ddpack completion bash), written from its parser\n"
        "_ddpack_runs() {\n"
        "    ddpack ls --json --no-slurm 2>/dev/null | python3 -c 'import json, sys\n"
        'for run in json.load(sys.stdin): print(run["run_dir"]); run.get("job_id") and print(run["job_id"])\' 2>/dev/null\n'
        "}\n"
        "_ddpack() {\n"
        "    local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]} verb=${COMP_WORDS[1]}\n"
        "    COMPREPLY=()\n"
        "    local i  # after --: your program (a command), then its own words (files)\n"
        "    for ((i = 1; i < COMP_CWORD; i++)); do\n"
        "        if [[ ${COMP_WORDS[i]} == -- ]]; then\n"
        '            if ((i == COMP_CWORD - 1)); then COMPREPLY=($(compgen -c -- "$cur")); else compopt -o default; fi\n'
        "            return\n"
        "        fi\n"
        "    done\n"
        f'    if [[ $COMP_CWORD -eq 1 ]]; then COMPREPLY=($(compgen -W {shlex.quote(names)} -- "$cur")); return; fi\n'
        '    case "$verb" in\n' + "".join(cases) + "    esac\n"
        "}\n"
        "complete -F _ddpack ddpack\n"
    )


def _zsh_quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "'\\''").replace("[", "\\[").replace("]", "\\]").replace(":", "\\:")


def zsh(top: argparse.ArgumentParser) -> str:
    described = " ".join(f"'{verb.name}:{_zsh_quote(verb.help)}'" for verb in verbs(top))
    cases = []
    for verb in verbs(top):
        specs = []
        for flag, text, choices, takes in verb.flags:
            action = ""
            if takes:
                if choices:
                    action = f":value:({' '.join(choices)})"
                elif flag in FOLDER_FLAGS:
                    action = ":folder:_files -/"
                elif flag in FILE_FLAGS:
                    action = ":file:_files"
                else:
                    action = ":value: "
            specs.append(f"'{flag}[{_zsh_quote(text)}]{action}'")
        if verb.positional_choices:
            specs.append(f"'1:{verb.name}:({' '.join(verb.positional_choices)})'")
        elif verb.name in RUN_VERBS:
            specs.append("'*:run:_ddpack_runs'" if verb.name == "compare" else "'1:run:_ddpack_runs'")
        elif verb.name == "submit":
            specs.append("'1:project folder:_files -/'")
            specs.append("'*::command:_normal'")
        cases.append(f"    {verb.name}) _arguments -s {' '.join(specs)} ;;\n")
    return (
        "#compdef ddpack\n"
        "# zsh completion for ddpack (ddpack completion zsh), written from its parser\n"
        "_ddpack_runs() {\n"
        "    local -a runs\n"
        "    runs=(${(f)\"$(ddpack ls --json --no-slurm 2>/dev/null | python3 -c 'import json, sys\n"
        'for run in json.load(sys.stdin): print(run["run_dir"]); run.get("job_id") and print(run["job_id"])\' 2>/dev/null)"})\n'
        "    compadd -a runs\n"
        "}\n"
        "_ddpack() {\n"
        f"    local -a verbs; verbs=({described})\n"
        "    if (( CURRENT == 2 )); then _describe verb verbs; return; fi\n"
        "    words=(${words[2,-1]}); (( CURRENT-- ))\n"
        '    case "${words[1]}" in\n' + "".join(cases) + "    esac\n"
        "}\n"
        "# autoloaded from $fpath (as _ddpack): complete now; sourced: register\n"
        'if [[ "${funcstack[1]}" == _ddpack ]]; then _ddpack "$@"; else compdef _ddpack ddpack; fi\n'
    )


def script(top: argparse.ArgumentParser, shell: str) -> str:
    return bash(top) if shell == "bash" else zsh(top)
