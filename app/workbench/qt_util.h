#pragma once
// The few conversions every view needs between Qt and the core: file paths (in the file system's
// encoding, not UTF-8 by assumption), the core's wording of durations and byte counts, and the
// JSON-lines events of the `hydrahead` children the views run.
#include <QByteArray>
#include <QFile>
#include <QJsonDocument>
#include <QJsonObject>
#include <QProcess>
#include <QString>
#include <csignal>
#include <filesystem>

#include "core/util/strings.h"

namespace hh::workbench {

inline std::filesystem::path toPath(const QString& s) { return std::filesystem::path(QFile::encodeName(s).toStdString()); }
inline QString fromPath(const std::filesystem::path& p) { return QFile::decodeName(p.string().c_str()); }
// "12.3s", "4m05s", "2h07m"; "-" for a negative or unknown duration.
inline QString formatSeconds(double s) { return s >= 0 ? QString::fromStdString(util::format_seconds(s)) : QStringLiteral("-"); }
inline QString humanBytes(double b) { return QString::fromStdString(util::human_bytes(b)); }

// Sends SIGINT to a child process (waiting for one still starting to have an id); false when it has
// none. Never kill(0): that would reach this process's own group.
inline bool interruptChild(QProcess& child) {
  if (child.state() == QProcess::Starting) child.waitForStarted(5000);
  const qint64 pid = child.processId();
  if (child.state() != QProcess::Running || pid <= 0) return false;
  return ::kill(static_cast<pid_t>(pid), SIGINT) == 0;
}

// Takes the complete lines off `pending` (a child's output so far; a partial last line stays), trimmed,
// empty ones skipped: a JSON object with an "event" goes to on_event, any other line to on_text.
template <class OnEvent, class OnText>
void takeEventLines(QByteArray& pending, OnEvent&& on_event, OnText&& on_text) {
  int nl;
  while ((nl = pending.indexOf('\n')) >= 0) {
    const QByteArray line = pending.left(nl).trimmed();
    pending.remove(0, nl + 1);
    if (line.isEmpty()) continue;
    QJsonParseError err;
    const QJsonDocument doc = QJsonDocument::fromJson(line, &err);
    if (err.error == QJsonParseError::NoError && doc.isObject() && doc.object().contains(QStringLiteral("event")))
      on_event(doc.object());
    else
      on_text(QString::fromLocal8Bit(line));
  }
}

}  // namespace hh::workbench
