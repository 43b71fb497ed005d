#pragma once
// Every persisted option of the workbench, declared once with its key and default. Values live in
// the application's QSettings scope (organisation + application name set in main()).
#include <QByteArray>
#include <QSettings>
#include <QString>
#include <QStringList>
#include <QVariant>

namespace hh::workbench {

template <class T>
struct Option {
  const char* key;
  T default_value;

  T get() const { return QSettings().value(QLatin1String(key), QVariant::fromValue(default_value)).template value<T>(); }
  void set(const T& value) const { QSettings().setValue(QLatin1String(key), QVariant::fromValue(value)); }
  void reset() const { QSettings().remove(QLatin1String(key)); }
};

namespace options {
inline const Option<QStringList> kRecentCheckpoints{"files/recentCheckpoints", {}};  // newest first
inline const Option<QString> kLastOpenFolder{"files/lastOpenFolder", {}};  // where the folder dialog starts
inline const Option<QByteArray> kWindowGeometry{"window/geometry", {}};
inline const Option<QByteArray> kWindowState{"window/state", {}};
inline const Option<QStringList> kAnalysisMethods{"analysis/methods",
                                                  {"activation", "path", "attribution", "retrieval", "similarity"}};
inline const Option<QString> kAnalysisDevice{"analysis/device", "cpu"};
inline const Option<QString> kAnalysisDtype{"analysis/dtype", "f32"};
inline const Option<QString> kLastAnalysisFolder{"files/lastAnalysisFolder", {}};
inline const Option<QStringList> kRecentRuns{"runs/recent", {}};  // run directories, newest first
}  // namespace options

}  // namespace hh::workbench
