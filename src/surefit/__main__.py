from surefit.cli import run

run()  # main(), then the end of the process without the interpreter's teardown (cli.run says why)
