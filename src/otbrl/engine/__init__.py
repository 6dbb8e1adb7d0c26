"""otbrl.engine"""
