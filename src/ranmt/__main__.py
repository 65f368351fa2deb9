"""``python -m ranmt``: the same command line as ``ranmt``."""

from ranmt.cli import main

if __name__ == "__main__":
    main()
