"""The recipe's scripts import each other by module name (they run as scripts from this folder):
put the folder on sys.path for its tests, which the project's importlib import mode does not do."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
