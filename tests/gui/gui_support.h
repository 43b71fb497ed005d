#pragma once
// What the GUI tests share: a scratch folder per test program, the settings sandbox, paths of the
// bundled demo model and the built programs, running `hydrahead` to completion, and stand-in scripts.
#include <QCoreApplication>
#include <QProcess>
#include <QSettings>
#include <QStandardPaths>
#include <QString>
#include <QStringList>
#include <QtGlobal>
#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace hh::test::gui {

inline QString env(const char* name) { return QString::fromLocal8Bit(std::getenv(name) ? std::getenv(name) : ""); }
inline QString qpath(const std::filesystem::path& p) { return QString::fromStdString(p.string()); }

// $HH_TEST_TMP/<name> (or the system temp folder), not created.
inline std::filesystem::path scratch(const char* name) {
  const QString tmp = env("HH_TEST_TMP");
  return (tmp.isEmpty() ? std::filesystem::temp_directory_path() : std::filesystem::path(tmp.toStdString())) / name;
}

// A fresh scratch folder, and QSettings kept in an INI file inside it, never the user's.
inline std::filesystem::path fresh_scratch(const char* name) {
  QStandardPaths::setTestModeEnabled(true);
  const auto root = scratch(name);
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root);
  QSettings::setDefaultFormat(QSettings::IniFormat);
  QSettings::setPath(QSettings::IniFormat, QSettings::UserScope, qpath(root / "settings"));
  QCoreApplication::setOrganizationName(QStringLiteral("HydraHeadTest"));
  QCoreApplication::setApplicationName(QString::fromLatin1(name));
  return root;
}

inline std::filesystem::path demo_model() {
  return std::filesystem::path(env("HH_SOURCE_DIR").toStdString()) / "datasets/models/hydrahead-demo";
}
inline QString program(const char* name) { return env("HH_BIN_DIR") + QLatin1Char('/') + QLatin1String(name); }

// A shell script at p with this text, executable by its owner (a stand-in for a program a view runs).
inline bool write_script(const std::filesystem::path& p, const char* text) {
  {
    std::ofstream out(p);
    if (!(out << text)) return false;
  }
  std::error_code ec;
  std::filesystem::permissions(p, std::filesystem::perms::owner_all, ec);
  return !ec;
}

// Runs a program to completion; false (with its output as a warning) unless it exits 0.
inline bool run_program(const QString& program, const QStringList& args, QString* output = nullptr) {
  QProcess p;
  p.setProcessChannelMode(QProcess::MergedChannels);
  p.start(program, args);
  if (!p.waitForFinished(300000)) return false;
  const QString out = QString::fromLocal8Bit(p.readAll());
  if (output) *output = out;
  if (p.exitStatus() != QProcess::NormalExit || p.exitCode() != 0) {
    qWarning("%s %s failed:\n%s", qPrintable(program), qPrintable(args.join(QLatin1Char(' '))), qPrintable(out));
    return false;
  }
  return true;
}
inline bool run_hydrahead(const QStringList& args, QString* output = nullptr) {
  return run_program(program("hydrahead"), args, output);
}

}  // namespace hh::test::gui
