"""`python -m dflash_trt ...`: the `dflash-trt` command, for an environment whose scripts folder is not on PATH
(a venv not activated, `pip install --user`)."""

from dflash_trt.cli import main

if __name__ == "__main__":
    main()
