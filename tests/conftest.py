import os
import sys

# The helpers in this folder (distributed harness, toy models) are imported by the spawned ranks too.
sys.path.insert(0, os.path.dirname(__file__))
