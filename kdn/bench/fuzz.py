"""`kdn bench fuzz`: hostile input against a real edge's HTTP API for --seconds (driver: kdn.fuzz)."""
import sys

from kdn.fuzz import main

if __name__ == "__main__":
    sys.exit(main())
