"""The entry script of the shared launches (tests/dist/conftest.py `dist_launch`): every case names
its worker module, whose `run_case` runs it (`_rank.serve`)."""
from _rank import serve

if __name__ == "__main__":
    serve(None)
