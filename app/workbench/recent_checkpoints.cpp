#include "recent_checkpoints.h"

#include <QDir>
#include <QFileInfo>

namespace hh::workbench {

QString normalizedCheckpointPath(const QString& path) {
  const QFileInfo info(path);
  const QString canonical = info.canonicalFilePath();  // empty when the path does not exist
  return canonical.isEmpty() ? QDir::cleanPath(info.absoluteFilePath()) : canonical;
}

QStringList withRecentCheckpoint(QStringList list, const QString& path, int max) {
  const QString entry = normalizedCheckpointPath(path);
  list.removeAll(entry);
  list.prepend(entry);
  while (list.size() > max && !list.isEmpty()) list.removeLast();
  return list;
}

QStringList withoutMissingCheckpoints(const QStringList& list) {
  QStringList kept;
  for (const QString& entry : list)
    if (QFileInfo(entry).isDir()) kept.append(entry);
  return kept;
}

}  // namespace hh::workbench
