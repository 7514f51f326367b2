import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))   # the serve_helpers and kept_once modules
