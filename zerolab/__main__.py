"""The `zerolab` command (also `python -m zerolab`).

    zerolab grade [PATH] [--gradescope results.json] [--csv grades.csv]   grade exercises
    zerolab demo [--world-size N ...]                                    the instructor demo
"""
import sys


def _grade(argv):
    from zerolab.grade import main  # imported here: `import zerolab` stays light
    return main(argv)


def _demo(argv):
    from zerolab.demo import main
    return main(argv)


COMMANDS = {"grade": _grade, "demo": _demo}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
