#include "head_grid_model.h"

#include <QBrush>
#include <QGuiApplication>
#include <QPalette>

namespace hh::workbench {
namespace {

// Two hues far apart on the colour wheel (blue, amber): even groups take the first, odd the second.
constexpr int kGroupHues[2] = {/*blue=*/212, /*amber=*/36};

bool darkPalette() {
  return QGuiApplication::palette().color(QPalette::Base).lightness() < 128;
}

}  // namespace

HeadGridModel::HeadGridModel(QObject* parent) : QAbstractTableModel(parent) {}

void HeadGridModel::setShape(int layers, int query_heads, int kv_heads) {
  const bool valid = layers > 0 && query_heads > 0 && kv_heads > 0 && query_heads % kv_heads == 0;
  beginResetModel();
  layers_ = valid ? layers : 0;
  query_heads_ = valid ? query_heads : 0;
  kv_heads_ = valid ? kv_heads : 0;
  endResetModel();
}

QColor HeadGridModel::groupTint(int group) const {
  const int hue = kGroupHues[group % 2];
  // Soft tints keep the digits readable; dark palettes get deep tones instead of pastels.
  return darkPalette() ? QColor::fromHsl(hue, 90, 62) : QColor::fromHsl(hue, 170, 222);
}

QColor HeadGridModel::groupTextColor(int group) const {
  Q_UNUSED(group);
  return darkPalette() ? QColor(235, 235, 235) : QColor(40, 44, 52);
}

int HeadGridModel::rowCount(const QModelIndex& parent) const { return parent.isValid() ? 0 : layers_; }

int HeadGridModel::columnCount(const QModelIndex& parent) const { return parent.isValid() ? 0 : query_heads_; }

QVariant HeadGridModel::data(const QModelIndex& index, int role) const {
  if (!checkIndex(index, CheckIndexOption::IndexIsValid | CheckIndexOption::ParentIsInvalid)) return {};
  const int layer = index.row();
  const int head = index.column();
  const int group = kvGroup(head);
  switch (role) {
    case Qt::DisplayRole:
    case KvGroupRole:
      return group;
    case LayerRole:
      return layer;
    case HeadRole:
      return head;
    case Qt::BackgroundRole:
      return QBrush(groupTint(group));
    case Qt::ForegroundRole:
      return QBrush(groupTextColor(group));
    case Qt::TextAlignmentRole:
      return int(Qt::AlignCenter);
    case Qt::ToolTipRole: {
      const int first = group * groupSize();
      const int last = first + groupSize() - 1;
      const QString heads = first == last ? tr("head %1").arg(first) : tr("heads %1\u2013%2").arg(first).arg(last);
      return tr("layer %1, head %2, KV group %3 (%4)").arg(layer).arg(head).arg(group).arg(heads);
    }
    default:
      return {};
  }
}

QVariant HeadGridModel::headerData(int section, Qt::Orientation orientation, int role) const {
  if (section < 0) return {};
  if (role == Qt::DisplayRole) return orientation == Qt::Horizontal ? QStringLiteral("H%1").arg(section)
                                                                     : QStringLiteral("L%1").arg(section);
  if (role == Qt::ToolTipRole) {
    if (orientation == Qt::Horizontal && section < query_heads_)
      return tr("query head %1, reads KV head %2").arg(section).arg(kvGroup(section));
    if (orientation == Qt::Vertical && section < layers_) return tr("layer %1").arg(section);
  }
  if (role == Qt::TextAlignmentRole) return int(Qt::AlignCenter);
  return {};
}

}  // namespace hh::workbench
