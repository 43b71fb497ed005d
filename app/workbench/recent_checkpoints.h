#pragma once
// The File > Open Recent list: newest first, no duplicates, at most kMaxRecentCheckpoints, and
// folders that no longer exist are dropped when the list is shown.
#include <QString>
#include <QStringList>

namespace hh::workbench {

inline constexpr int kMaxRecentCheckpoints = 8;

// The absolute, clean form under which a folder is remembered (symlinks resolved when it exists).
QString normalizedCheckpointPath(const QString& path);
// `list` with `path` moved (or added) to the front, duplicates removed, cut to `max` entries.
QStringList withRecentCheckpoint(QStringList list, const QString& path, int max = kMaxRecentCheckpoints);
// `list` without the entries that are not existing folders.
QStringList withoutMissingCheckpoints(const QStringList& list);

}  // namespace hh::workbench
