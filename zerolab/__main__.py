"""The `zerolab` command (also `python -m zerolab`).

    zerolab grade [PATH] [--gradescope results.json] [--csv grades.csv]   grade exercises
    zerolab demo [--world-size N ...]                                    the instructor demo
"""
import sys


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"grade": "zerolab.grade", "demo": "zerolab.demo"}
    if not argv or argv[0] not in commands:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    import importlib
    return importlib.import_module(commands[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
