from stepdeploy.cli.app import main

main()
